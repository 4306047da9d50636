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
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layers")  # the decoder's layer count, as configs name it


def ask(dirs: dict[str, Path], engines: tuple[str, ...], formats: tuple[str, ...], trust_remote_code: bool = False
        ) -> dict[str, dict]:
    """Each engine's draft answers: {engine: {"trace": result, "builds": {format: result}}}; an engine without a draft
    for the architecture answers with its error (kept: the table says so)."""
    from ..enginecheck import run_derive

    out = {}
    for e in engines:
        kw = {"draft": True, "trust_remote_code": trust_remote_code}
        trace = run_derive(dirs["plain"], e, "trace", dirs["weights"], **kw)
        builds = {} if trace.get("error") else {f: run_derive(dirs[f], e, "build", **kw) for f in formats}
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
        # no config key counts them (LongCat-Flash, MiMo-V2-Flash): the layers stored under the block are the count
        return {"prefix": block, "count": [key]} if key else {"prefix": block, "count": [], "count_stored": True}
    return None


def _first(text: dict, drafts: dict[str, dict]) -> tuple[str, int] | None:
    """How the drafts number their layers under a block prefix (the config path, or ``k * path``, whose value is the
    first MTP layer's number in the drafts' quant prefixes, and that number): ``num_hidden_layers`` where it is one
    of them (vLLM's DeepSeekV4MTP), else the decoder's layer count or its double (vLLM's LongCatFlashMTP numbers its
    one layer ``2 * num_layers``: ``longcat_flash_mtp.py`` ``mtp_start_layer_idx``); None where no draft numbers them
    so."""
    seen = {int(h.group(1)) for a in drafts.values() for b in a.get("builds", {}).values()
            for info in b.get("modules", {}).values()
            if (h := re.search(r"\blayers\.(\d+)\.", info.get("quant_prefix") or ""))}
    for k in _LAYER_COUNTS:
        v = text.get(k)
        if type(v) is not int or v <= 0:
            continue
        for mult in (1, 2):
            if mult * v in seen:
                return (k if mult == 1 else f"{mult} * {k}"), mult * v
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
    """``name`` with its MTP layer's number as ``{n}`` (its index under a block prefix as ``{i}``: DeepSeek V4's
    ``mtp.{i}.``, Qwen3.5's ``mtp.layers.{i}.``) and an expert's index as ``{expert}``."""
    if "{n}" in prefix:
        hit = next((p for p in mtp_prefixes if name.startswith(p)), None)
        if hit is not None:
            name = prefix + name[len(hit):]
    elif name.startswith(prefix):
        name = prefix + re.sub(r"^((?:layers\.)?)\d+\.", r"\1{i}.", name[len(prefix):])
    return _EXPERT.sub(".experts.{expert}.", name)


def _draft_templ(qp: str, src: str, prefix: str, first: int | None, count: int) -> str:
    """The draft's quant prefix ``qp`` for source ``src`` as a template: under a block prefix its MTP layer's number
    as the draft spells it, ``{n}`` where it is the stand-in's ``num_hidden_layers`` (``first``) + the layer's index
    (vLLM's DeepSeekV4MTP: ``mtp.0.`` -> ``model.layers.43.`` in the release, 4 in the stand-in), ``{i}`` where it
    is the index (vLLM's MiniMaxM3MTP: ``model.layers.0.``); a source outside the block (the target's ``lm_head``)
    stands for every layer's."""
    if "{n}" in prefix:
        return qp
    hit = re.match(re.escape(prefix) + r"(?:layers\.)?(\d+)\.", src)
    for i in ([int(hit.group(1))] if hit else range(count)):
        if first is not None and (m := re.search(rf"\blayers\.{first + i}\.", qp)):
            return qp[: m.start()] + "layers.{n}." + qp[m.end():]
        if hit and (m := re.search(rf"\blayers\.{i}\.", qp)):
            return qp[: m.start()] + "layers.{i}." + qp[m.end():]
    return qp


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
                out.add(_templ(src[: -len(".weight")], mtp_prefixes, loc["prefix"]).replace("{n}", "*").replace(
                    "{i}", "*"))
    return sorted(out)


def draft_entry(engine: str, answers: dict, loc: dict, mtp_prefixes: list[str], first: int | None = None,
                count: int = 1) -> dict:
    """One engine's ``[[mtp.draft]]`` from its answers (see the module docstring); ``first`` / ``count``: the
    stand-in's ``num_hidden_layers`` and MTP layer count, which a draft's layer numbers under a block prefix are
    read against (``_draft_templ``)."""
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
                names.add((_templ(src, mtp_prefixes, loc["prefix"]),
                           _draft_templ(_templ(qp, mtp_prefixes, loc["prefix"]), src, loc["prefix"], first, count)))
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
    n = _count(loc, text, mtp_names)
    if "{n}" in loc["prefix"]:
        prefixes = [loc["prefix"].replace("{n}", str(text["num_hidden_layers"] + i)) for i in range(n)]
    else:
        prefixes = [loc["prefix"]]
    how = ("num_hidden_layers", text["num_hidden_layers"]) if "first" in loc else _first(text, drafts)
    entries = [draft_entry(e, a, loc, prefixes, how[1] if how else None, n) for e, a in sorted(drafts.items())]
    out = dict(loc)
    if "first" not in loc and how and any("{n}" in dst for d in entries for _, dst in d.get("names", [])):
        out = {"prefix": loc["prefix"], "first": how[0], **loc}  # the drafts number {n} from it
    out["reason"] = "the engines' main models drop these layers on purpose; their speculative-decoding drafts load them"
    out["draft"] = entries
    return out


def mtp_embeddings(mtp_names: list[str], config: dict, drafts: dict[str, dict]) -> list[str]:
    """:func:`embeddings` of the MTP layers the main models drop (none where they drop none)."""
    loc = locate(mtp_names, config)
    if loc is None:
        return []
    text, _ = _text(config)
    n = _count(loc, text, mtp_names)
    prefixes = ([loc["prefix"].replace("{n}", str(text["num_hidden_layers"] + i)) for i in range(n)]
                if "{n}" in loc["prefix"] else [loc["prefix"]])
    return embeddings(drafts, loc, prefixes)


def _count(loc: dict, text: dict, mtp_names: list[str]) -> int:
    """The stand-in's MTP layer count: its config key's value, else the layers its names store (``count_stored``)."""
    n = next((text.get(k) for k in loc.get("count", []) if isinstance(text.get(k), int)), None)
    if n is None and loc.get("count_stored"):
        n = len({h.group(2) for m in mtp_names if (h := _LAYER.match(m))})
    return n or 1
