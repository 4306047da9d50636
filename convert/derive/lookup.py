"""Which table a checkpoint gets: a hand table, else a shipped derived one, else one derived now (and cached).

The order, each step only where the one before has none: ``--mapping``; a hand table naming the architecture
(``mappings/*.toml``); a derived table shipped for it (``mappings/derived/*.toml``, made by
``scripts/derive_breadth.py`` from the engines pinned here); a hand table naming the config's model_type (the
engines dispatch on the architecture: Mistral Large 3's params.json reads as model_type deepseek_v3, whose hand
table is not its own); one in the cache for this config and these engine versions; one derived now, when the
engine environments exist (``scripts/engine-envs.sh``). A hand overlay (``mappings/overlays/NAME.toml``) is merged
over any derived table.
"""

from __future__ import annotations

import os
import tomllib
from importlib import resources
from pathlib import Path

from ..checkpoint import Checkpoint
from ..errors import ConvertError
from ..mapping import Mapping, UnknownArchitecture, find_mapping, parse_mapping


def _shipped(folder: str) -> dict[str, tuple[str, str]]:
    """file name -> (path shown, text) of the TOML files in ``kimi_convert.mappings/FOLDER``."""
    root = resources.files("kimi_convert.mappings") / folder
    if not root.is_dir():
        return {}
    return {f.name: (f"mappings/{folder}/{f.name}", f.read_text(encoding="utf-8"))
            for f in sorted(root.iterdir(), key=lambda f: f.name) if f.name.endswith(".toml")}


def overlay_for(name: str) -> tuple[str, dict] | None:
    """The hand overlay of derived table ``name`` (``derived-glm_moe_dsa`` -> ``overlays/glm_moe_dsa.toml``)."""
    hit = _shipped("overlays").get(name.removeprefix("derived-") + ".toml")
    return None if hit is None else (hit[0], tomllib.loads(hit[1]))


def finish(text: str, where: str) -> Mapping:
    """A derived table's text with its overlay merged, parsed (the overlay's file named in the manifest's text)."""
    import tomli_w

    from . import merge

    t = tomllib.loads(text)
    ov = overlay_for(t.get("name", ""))
    if ov is not None:
        t = merge(t, ov[1])
        head = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))  # the derivation's notes
        text = f"{head}# merged with {ov[0]}\n{tomli_w.dumps(t)}"  # the merged table alone: no key twice
    return parse_mapping(text, where)


def shipped_for(config: dict) -> Mapping | None:
    """The shipped derived table naming one of the config's architectures; only a table whose text holds one of their
    names is parsed (parsing all 30 cost each pack's start about 50 ms)."""
    archs = set(config.get("architectures") or [])
    for _, (where, text) in _shipped("derived").items():
        if not any(a in text for a in archs):
            continue
        t = tomllib.loads(text)
        if archs & set(t.get("architectures", ())):
            return finish(text, where)
    return None


def _engines_present() -> bool:
    from ..enginecheck import ENGINES, EngineUnavailable, find_python

    try:
        for e in ENGINES:
            find_python(e)
    except EngineUnavailable:
        return False
    return True


def cached_or_derived(ckpt: Checkpoint) -> Mapping:
    """The cache's table for this config and the engines' versions, or one derived now and cached."""
    from ..enginecheck import ENGINES, resolve
    from . import cache_dir, cache_key, derive

    versions = {e: resolve(e).version for e in ENGINES}
    path = cache_dir() / f"{cache_key(ckpt.config, versions)}.toml"
    if not path.is_file():
        d = derive(ckpt)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(d.text)
        tmp.replace(path)
    return finish(path.read_text(), str(path))


def shipped_table(config: dict) -> Mapping:
    """The table ``config`` gets from what ships, no engine asked: a hand table naming its architecture, a derived table
    shipped for it, a hand table naming its model_type, in that order (the module docstring); ``UnknownArchitecture``
    where none does."""
    try:
        return find_mapping(config, by_model_type=False)
    except UnknownArchitecture:
        found = shipped_for(config)
        if found is not None:
            return found
        return find_mapping(config)  # a hand table of the model_type, for an architecture none names


def mapping_for(ckpt: Checkpoint, override: str | os.PathLike | None = None) -> Mapping:
    """The table for ``ckpt`` (see the module docstring)."""
    if override is not None:
        return find_mapping(ckpt.config, override)
    try:
        return shipped_table(ckpt.config)
    except UnknownArchitecture as e:
        if not _engines_present():
            raise ConvertError(f"{e}; or create the engine environments (scripts/engine-envs.sh) and a table is "
                               "derived from the engines' own model classes") from None
        try:
            return cached_or_derived(ckpt)
        except ConvertError as why:
            raise ConvertError(f"{e}; deriving one from the engines' model classes failed: {why}") from None


def write_table(text: str, out: Path | None) -> None:
    if out is None:
        print(text, end="")
        return
    Path(out).write_text(text)



