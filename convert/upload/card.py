"""The model card ``upload`` writes where an output has none: what was quantized how, and why kept."""

from __future__ import annotations

from collections.abc import Iterable

from huggingface_hub import ModelCard, ModelCardData

from .. import formats, schemes
from ..plan import Kind


def model_card(man: dict, config: dict, base_model: str | None, modules: Iterable[dict] | None = None) -> str:
    """``modules``: the manifest's module records (``iter_modules``; default: manifest.json's own, a
    version 1 or 2 manifest), read once, in a stream."""
    counts = dict.fromkeys(Kind, 0)
    cast_n, cast_blocks, cast_lossless, cast_kind = 0, 0, 0, None
    reasons: dict[str, int] = {}
    for m in man["modules"] if modules is None else modules:
        counts[m["kind"]] += 1
        q = m.get("quantization") or {}
        if q.get("method") == "mxfp4-cast":
            cast_n, cast_blocks, cast_kind = cast_n + 1, cast_blocks + q["blocks"], m["kind"]
            cast_lossless += q["lossless_blocks"]
        if m["kind"] == Kind.KEEP:
            reasons[m["rule"]] = reasons.get(m["rule"], 0) + 1
    lossless = f"{cast_lossless} of {cast_blocks}"
    recipe = man.get("recipe") or {"name": "?", "quant_method": "modelopt", "quant_algo": "W4A16_NVFP4"}
    fmt = formats.get(recipe.get("output_format", formats.DEFAULT))
    base = base_model or config.get("_name_or_path") or ""
    # the metadata block is huggingface_hub's (ModelCardData writes the YAML the Hub parses)
    data = ModelCardData(base_model=base or None, library_name="transformers", tags=list(fmt.CARD_TAGS))
    body = [
        f"# {(config.get('architectures') or ['model'])[0]}, NVFP4",
        "",
        f"NVFP4 checkpoint ({fmt.card_line(recipe)}) written by "
        f"kimi-convert {man['tool']['version']}"
        + (f" from `{base}`" if base else "") + ". `manifest.json` records the source of every tensor and "
        "the digest of every file and the BLAKE3 of every tensor; `kimi-convert verify-manifest` checks it "
        "(`--engine vllm|sglang` loads it with the engine's own code).",
        "",
        "| | modules |",
        "|---|---|",
        *[f"| quantized to {s.CARD} | {counts[n]}"
          + (f" ({cast_n} cast from MXFP4; {lossless} blocks lossless)" if cast_n and n == cast_kind else "") + " |"
          for n, s in schemes.SCHEMES.items()],
        f"| linear layers kept in high precision | {counts['keep']} |",
        f"| other tensors copied unchanged | {counts['copy']} |",
        "",
        "Kept in high precision, and why:",
        "",
        "| rule | modules |",
        "|---|---|",
        *[f"| {r.replace('|', '/')} | {n} |" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])],
        "",
        f"Mapping `{man['mapping']['name']}` (sha256 `{man['mapping']['sha256'][:16]}`); "
        f"{len(man['exclude_modules'])} names in `exclude_modules`.",
        "",
    ]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)))
