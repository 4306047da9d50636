"""A mapping table's ``[mtp]`` (convert/mtp.py) derived from the engines' own speculative-decoding draft models.

The main models' trace already says which source tensors are MTP layers (each engine's own rule drops them:
``mtp_skipped``); from their names and the config this locates the MTP layers (``prefix``, ``first``, ``count``).
Then each engine builds its draft model for the stand-in (``--derive trace --draft``: the class and config a deployment
builds with ``--speculative-config`` / ``--speculative-algorithm NEXTN``; ``enginecheck.run_derive``) and, under each
output format's quantization config that ignores nothing (``--derive build --draft``), reports every module's quant
method and the prefix it asked its quant method with. From those:

- ``quantized``: the formats under which the draft builds some MTP linear layer quantized (SGLang's NextN models build
  the whole layer unquantized under a ModelOpt NVFP4 config, whatever the checkpoint holds);
- ``unquantized``: per format, the MTP source modules whose draft module is built unquantized (``eh_proj``, a router);
- ``names``: each source module that lands in a draft module asking its quant method under another name than the
  source's, with that name (vLLM's ``Glm4MoeMTP``: ``q_proj`` -> ``model.layers.{n}.self_attn.qkv_proj``, no packed
  mapping to find its shards by; the target's ``lm_head`` -> ``model.layers.{n}.head``);
- ``from_target``: the draft parameters the engine takes from the target model after loading.

Pure but for :func:`ask` (the engine runs).
"""

from __future__ import annotations

import re
from pathlib import Path

_LAYER = re.compile(r"^(.*?\blayers\.)(\d+)\.")
_EXPERT = re.compile(r"\.experts\.\d+\.")
_COUNT_HINTS = ("nextn", "mtp")


def ask(dirs: dict[str, Path], engines: tuple[str, ...], formats: tuple[str, ...]) -> dict[str, dict]:
    """Each engine's draft answers: {engine: {"trace": result, "builds": {format: result}}}; an engine without a draft
    for the architecture answers with its error (kept: the table says so)."""
    from ..enginecheck import run_derive

    out = {}
    for e in engines:
        trace = run_derive(dirs["plain"], e, "trace", dirs["weights"], draft=True)
        builds = {} if trace.get("error") else {f: run_derive(dirs[f], e, "build", draft=True) for f in formats}
        out[e] = {"trace": trace, "builds": builds}
    return out


def _text(config: dict) -> tuple[dict, str]:
    text = config.get("text_config")
    return (text, "") if isinstance(text, dict) else (config, "")


def _count_key(text: dict, n: int) -> str | None:
    keys = sorted(k for k, v in text.items() if type(v) is int and v == n and any(h in k for h in _COUNT_HINTS))
    return keys[0] if keys else None


def locate(mtp_names: list[str], config: dict) -> dict | None:
    """``prefix``, ``first``, ``count`` of the MTP layers the main models drop (their own rule's names), or None."""
    if not mtp_names:
        return None
    text, _ = _text(config)
    hits = [_LAYER.match(n) for n in mtp_names]
    heads = {h.group(1) for h in hits if h}
    base = text.get("num_hidden_layers")
    if all(hits) and len(heads) == 1 and isinstance(base, int):
        nums = {int(h.group(2)) for h in hits if h}
        if min(nums) >= base:
            key = _count_key(text, len(nums))
            return {"prefix": f"{heads.pop()}{{n}}.", "first": "num_hidden_layers", "count": [key] if key else []}
    block = _block(mtp_names)
    if block:
        key = _count_key(text, max(1, len({h.group(2) for h in hits if h})))
        return {"prefix": block, "count": [key] if key else []}
    return None


def _block(names: list[str]) -> str:
    """The MTP block's prefix: the dotted parts all ``names`` share, up to its layer list (``layers`` or an index;
    Qwen3.5's and DeepSeek V4's ``mtp.``, MiniMax M3's ``language_model.model.mtp.``, not the ``language_model.``
    the whole text model shares)."""
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for column in zip(*parts, strict=False):  # as far as the shortest name
        if len(set(column)) != 1 or column[0] == "layers" or column[0].isdigit():
            break
        common.append(column[0])
    return "".join(f"{p}." for p in common)


def _templ(name: str, mtp_prefixes: list[str], prefix: str) -> str:
    """``name`` with its MTP layer's number as ``{n}`` and an expert's index as ``{expert}``."""
    if "{n}" in prefix:
        hit = next((p for p in mtp_prefixes if name.startswith(p)), None)
        if hit is not None:
            name = prefix + name[len(hit):]
    return _EXPERT.sub(".experts.{expert}.", name)


def _unquantized(method: str | None, kind: str) -> bool:
    return kind == "other" or method is None or "Unquantized" in method


def _is_head(info: dict) -> bool:
    """An output head (``ParallelLMHead``): an embedding class the engines quantize like a linear layer where its
    config does (vLLM's DeepSeekMTP builds the MTP layer's ``shared_head.head`` with ModelOpt's linear method, and
    with ``UnquantizedEmbeddingMethod`` under compressed-tensors)."""
    return "LMHead" in (info.get("class") or "")


def embeddings(drafts: dict[str, dict], loc: dict, mtp_prefixes: list[str]) -> list[str]:
    """Globs of the MTP source modules some draft loads into an embedding that is no output head (the MTP layer's
    own ``embed_tokens``, which vLLM's DeepSeekMTP reads into its ``model.embed_tokens``): ``not_linear``."""
    out: set[str] = set()
    for answers in drafts.values():
        trace = answers.get("trace", {})
        mods = trace.get("modules", {})
        for s in trace.get("spans", []):
            src, param = s["tensor"], s["param"]
            if not (src.endswith(".weight") and src.startswith(tuple(mtp_prefixes))):
                continue
            info = mods.get(param.rpartition(".")[0]) or next(
                (b.get("modules", {}).get(param.rpartition(".")[0]) for b in answers.get("builds", {}).values()
                 if param.rpartition(".")[0] in b.get("modules", {})), None)
            if info and info.get("kind") == "embedding" and not _is_head(info):
                out.add(_templ(src[: -len(".weight")], mtp_prefixes, loc["prefix"]).replace("{n}", "*"))
    return sorted(out)


def draft_entry(engine: str, answers: dict, loc: dict, mtp_prefixes: list[str]) -> dict:
    """One engine's ``[[mtp.draft]]`` from its answers (see the module docstring)."""
    trace = answers["trace"]
    label = {"vllm": "vLLM", "sglang": "SGLang"}.get(engine, engine)
    cls = trace.get("model_class") or "?"
    if trace.get("error"):
        err = trace["error"]
        return {"engine": engine, "model_class": cls, "quantized": [],
                "reason": f"{label} {trace.get('version')}: no draft model: {err['type']}: "
                          f"{(err.get('message') or '').splitlines()[0][:200] if err.get('message') else ''}"}
    land: dict[str, str] = {}  # source module -> draft module (attribute path)
    for s in trace.get("spans", []):
        if s["tensor"].endswith(".weight") and s["param"].endswith("weight"):
            land.setdefault(s["tensor"][: -len(".weight")], s["param"].rpartition(".")[0])
    for t in trace.get("from_target", []):  # what the engine takes from the target: the target's module's name
        if t.get("target") == "lm_head":
            land.setdefault("lm_head", t["param"].rpartition(".")[0])
    quantized, unquantized, names = [], {}, set()
    for fmt, b in sorted(answers["builds"].items()):
        mods = b.get("modules", {})
        off = set()
        any_q = False
        for src, attr in sorted(land.items()):
            info = mods.get(attr)
            if info is None or (info.get("kind") == "embedding" and not _is_head(info)) or not src.startswith(
                    tuple(mtp_prefixes)) or (
                    info.get("kind") == "other" and len(info.get("params", {}).get("weight", ())) != 2):  # a norm
                continue
            if _unquantized(info.get("quant_method"), info.get("kind", "other")):
                off.add(_templ(src, mtp_prefixes, loc["prefix"]))
            else:
                any_q = True
        for src, attr in land.items():
            qp = (mods.get(attr) or {}).get("quant_prefix")
            if qp and qp != src:
                names.add((_templ(src, mtp_prefixes, loc["prefix"]), _templ(qp, mtp_prefixes, loc["prefix"])))
        if any_q:
            quantized.append(fmt)
        unquantized[fmt] = sorted(off)
    why = f"{label} {trace.get('version')}: {cls}, built as a deployment's speculative config builds it"
    return {"engine": engine, "model_class": cls, "quantized": quantized, "unquantized": unquantized,
            "names": [list(p) for p in sorted(names)],
            "from_target": sorted(t["param"] for t in trace.get("from_target", [])), "reason": why}


def section(mtp_names: list[str], config: dict, drafts: dict[str, dict]) -> dict | None:
    """The ``[mtp]`` table, or None where no engine's main model drops an MTP layer."""
    loc = locate(mtp_names, config)
    if loc is None:
        return None
    text, _ = _text(config)
    n = next((text.get(k) for k in loc.get("count", []) if isinstance(text.get(k), int)), 1)
    if "{n}" in loc["prefix"]:
        prefixes = [loc["prefix"].replace("{n}", str(text["num_hidden_layers"] + i)) for i in range(n)]
    else:
        prefixes = [loc["prefix"]]
    out = dict(loc)
    out["reason"] = "the engines' main models drop these layers on purpose; their speculative-decoding drafts load them"
    out["draft"] = [draft_entry(e, a, loc, prefixes) for e, a in sorted(drafts.items())]
    return out


def mtp_embeddings(mtp_names: list[str], config: dict, drafts: dict[str, dict]) -> list[str]:
    """:func:`embeddings` of the MTP layers the main models drop (none where they drop none)."""
    loc = locate(mtp_names, config)
    if loc is None:
        return []
    text, _ = _text(config)
    n = next((text.get(k) for k in loc.get("count", []) if isinstance(text.get(k), int)), 1)
    prefixes = ([loc["prefix"].replace("{n}", str(text["num_hidden_layers"] + i)) for i in range(n)]
                if "{n}" in loc["prefix"] else [loc["prefix"]])
    return embeddings(drafts, loc, prefixes)
