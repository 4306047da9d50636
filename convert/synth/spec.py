"""Preset spec files (docs/presets.md): one TOML file per model family, read into typed values.

A family is data: the ``config.json`` to write, the tensors in the release's order as name templates
with shapes over config keys, the storage of each (BF16, FP8 blocks, MXFP4, ...), how the release cuts
its shards, and its side files; its size variants (``tiny-*``, ``bench-*``) are config values. Adding a
family is writing such a file, not code. Everything is checked when the file is read (keys, types,
expression syntax) or, for what depends on a variant's values, when the variant is resolved; an error
is one line naming the file and the entry.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .. import filenames
from ..errors import ConvertError
from .expr import Expr, ExprError, parse

#: storages a tensor template may name (docs/presets.md, "Storage")
STORAGES = ("bf16", "f32", "fp8-block", "mxfp4-pack", "mxfp4-bank", "int4-pack", "expert-ids")
CUTS = ("count", "bytes", "layers")


class SpecError(ConvertError):
    """A spec file's mistake, as one line: ``FILE: ENTRY: what is wrong``."""

    def __init__(self, where: str, msg: str) -> None:
        super().__init__(f"{where}: {msg}")


@dataclass(frozen=True)
class Tensor:
    """One tensor template: emitted once per loop pass (and expert) where its conditions hold."""

    where: str  # "FILE: blocks[1].tensors[4] (name template)", for errors
    name: str
    shape: tuple[Expr, ...] | Expr
    storage: str
    when: Expr | None = None
    layers: Expr | None = None
    wide: Expr | None = None  # mxfp4: one block scaled by 2^-24 (a cast that must refuse)
    zero_from: Expr | None = None  # values from this index of dim 0 on are zero (K3's A_log)
    scale_apart: Expr | None = None  # fp8-block: the scale is stored in the last shard
    stored: tuple[str, ...] = ()  # the stored parts' names ({name}, {base}) instead of the storage's own
    scale_dtype: str = "u8"  # mxfp4: the E8M0 scales as U8 (compressed-tensors, gpt-oss) or F8_E8M0; fp8-block:
    # "e8m0" for power-of-two F8_E8M0 tile scales (DeepSeek's ue8m0) instead of F32
    code_dtype: str = "u8"  # mxfp4-pack: the packed E2M1 codes as U8 (compressed-tensors) or I8 (DeepSeek V4)


@dataclass(frozen=True)
class Group:
    """Entries sharing conditions; with ``experts``, emitted expert by expert (``{expert}``)."""

    where: str
    entries: tuple[Tensor | Group, ...]
    when: Expr | None = None
    layers: Expr | None = None
    experts: Expr | None = None


@dataclass(frozen=True)
class Block:
    """A run of entries, once or once per value of ``loop`` (bound to ``var``, ``layer`` by default)."""

    where: str
    entries: tuple[Tensor | Group, ...]
    loop: Expr | None = None
    var: str = "layer"
    names: tuple[tuple[str, str], ...] = ()  # literal strings the name templates may use ({pre})


@dataclass(frozen=True)
class Sharding:
    cut: str = "count"  # count: equal counts snapped onto `snap`; bytes: equal bytes; layers: by layer
    snap: tuple[str, ...] = (".k_proj.weight", ".up_proj.weight")
    name: str = "model-{index:05d}-of-{count:05d}.safetensors"
    sparse: bool = False  # headers real, data regions holes (the index sorted, as save_pretrained writes it)


@dataclass(frozen=True)
class Variant:
    name: str
    where: str
    description: str
    shards: int
    config: dict  # overrides of the family's config, dotted paths -> values
    sharding: Sharding


@dataclass(frozen=True)
class Family:
    path: str
    config: dict
    scope: tuple[str, ...]
    layers_key: str
    experts_key: str
    sets: dict[str, Expr]
    let: dict[str, Expr]
    blocks: tuple[Block, ...]
    files: dict[str, str]
    sharding: Sharding
    config_file: str = filenames.CONFIG  # Mistral's own layout: params.json (convert/mistral_checkpoint.py)
    index_file: str = filenames.INDEX  # Mistral's: consolidated.safetensors.index.json
    variants: dict[str, Variant] = field(default_factory=dict)


def _expr(value, where: str) -> Expr:
    try:
        return parse(value if isinstance(value, str) else str(value))
    except ExprError as e:
        raise SpecError(where, str(e)) from None


def _opt_expr(d: dict, key: str, where: str) -> Expr | None:
    return None if key not in d else _expr(d[key], f"{where}: {key}")


def _keys(d: dict, allowed: set[str], where: str) -> None:
    if not isinstance(d, dict):
        raise SpecError(where, f"expected a table, got {type(d).__name__}")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise SpecError(where, f"unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")


def _shape(value, where: str) -> tuple[Expr, ...] | Expr:
    if isinstance(value, str):
        return _expr(value, where)
    if not isinstance(value, list) or not all(isinstance(v, int | str) and not isinstance(v, bool) for v in value):
        raise SpecError(where, "shape is a list of integers / expressions, or one expression giving such a list")
    return tuple(_expr(v, where) for v in value)


_TENSOR_KEYS = {"name", "shape", "storage", "when", "layers", "wide", "zero_from", "scale_apart", "stored",
                "scale_dtype", "code_dtype"}
SCALE_DTYPES = ("u8", "e8m0")
CODE_DTYPES = ("u8", "i8")
_GROUP_KEYS = {"tensors", "when", "layers", "experts", "use"}


def _tensor(d: dict, where: str, default_storage: str) -> Tensor:
    _keys(d, _TENSOR_KEYS, where)
    if "shape" not in d:
        raise SpecError(where, "a tensor needs a shape")
    storage = d.get("storage", default_storage)
    if storage not in STORAGES:
        raise SpecError(where, f"unknown storage {storage!r} (known: {', '.join(STORAGES)})")
    stored, scale_dtype, code_dtype = d.get("stored", []), d.get("scale_dtype", "u8"), d.get("code_dtype", "u8")
    if not isinstance(d["name"], str) or not isinstance(stored, list) or not all(isinstance(s, str) for s in stored):
        raise SpecError(where, "name is a string, stored a list of strings")
    if scale_dtype not in SCALE_DTYPES or (scale_dtype != "u8" and storage not in ("mxfp4-pack", "mxfp4-bank",
                                                                                   "fp8-block")):
        raise SpecError(f"{where}: scale_dtype", f"{scale_dtype!r}: u8 or e8m0, for an mxfp4 or fp8-block storage")
    if code_dtype not in CODE_DTYPES or (code_dtype != "u8" and storage != "mxfp4-pack"):
        raise SpecError(f"{where}: code_dtype", f"{code_dtype!r}: u8 or i8, for the mxfp4-pack storage")
    return Tensor(where, d["name"], _shape(d["shape"], f"{where}: shape"), storage,
                  *(_opt_expr(d, k, where) for k in ("when", "layers", "wide", "zero_from", "scale_apart")),
                  tuple(stored), scale_dtype, code_dtype)


def _entry(d: dict, where: str, parts: dict, default_storage: str, depth: int) -> Tensor | Group:
    if isinstance(d, dict) and "name" in d:
        return _tensor(d, f"{where} ({d['name']})", default_storage)
    _keys(d, _GROUP_KEYS, where)
    if ("tensors" in d) == ("use" in d):
        raise SpecError(where, "an entry is a tensor (name, shape), a group (tensors = [...]) or a part (use = ...)")
    if "use" in d:
        if d["use"] not in parts:
            raise SpecError(where, f"unknown part {d['use']!r} (parts: {', '.join(parts) or 'none'})")
        entries = parts[d["use"]]
    else:
        entries = _entries(d["tensors"], where, parts, default_storage, depth + 1)
    return Group(where, entries, *(_opt_expr(d, k, where) for k in ("when", "layers", "experts")))


def _entries(items, where: str, parts: dict, default_storage: str, depth: int = 0) -> tuple[Tensor | Group, ...]:
    if depth > 8:
        raise SpecError(where, "groups nested more than 8 deep")
    if not isinstance(items, list):
        raise SpecError(where, "tensors is a list of tables")
    return tuple(_entry(d, f"{where}.tensors[{i}]", parts, default_storage, depth) for i, d in enumerate(items))


def _sharding(d: dict, where: str, base: Sharding) -> Sharding:
    _keys(d, {"cut", "snap", "name", "sparse"}, where)
    s = Sharding(d.get("cut", base.cut), tuple(d.get("snap", base.snap)), d.get("name", base.name),
                 d.get("sparse", base.sparse))
    if s.cut not in CUTS:
        raise SpecError(f"{where}: cut", f"unknown cut {s.cut!r} (known: {', '.join(CUTS)})")
    if not isinstance(s.sparse, bool) or not isinstance(s.name, str) or not all(isinstance(x, str) for x in s.snap):
        raise SpecError(where, "sparse is true/false, name a string, snap a list of strings")
    return s


def _blocks(raw, path: str, parts: dict, storage: str) -> tuple[Block, ...]:
    if not isinstance(raw, list) or not raw:
        raise SpecError(f"{path}: blocks", "a family needs [[blocks]] (its tensors, in the release's order)")
    out = []
    for i, b in enumerate(raw):
        where = f"{path}: blocks[{i}]"
        _keys(b, {"loop", "var", "names", "tensors"}, where)
        names = b.get("names", {})
        if not isinstance(names, dict) or not all(isinstance(v, str) for v in names.values()):
            raise SpecError(f"{where}: names", "names is a table of strings")
        var = b.get("var", "layer")
        if not isinstance(var, str) or not var.isidentifier():
            raise SpecError(f"{where}: var", f"{var!r} is not a name")
        out.append(Block(where, _entries(b.get("tensors", []), where, parts, storage), _opt_expr(b, "loop", where),
                         var, tuple(names.items())))
    return tuple(out)


def _exprs(raw, where: str) -> dict[str, Expr]:
    if not isinstance(raw, dict):
        raise SpecError(where, "expected a table of expressions")
    for k in raw:
        if not k.isidentifier() or k.startswith("_"):
            raise SpecError(where, f"{k!r} is not a plain name")
    return {k: _expr(v, f"{where}.{k}") for k, v in raw.items()}


_FAMILY_KEYS = {"family", "config", "sets", "let", "parts", "blocks", "files", "sharding", "presets", "base"}


def parse_family(doc: dict, path: str) -> Family:
    """A family file's layout (everything but its presets)."""
    _keys(doc, _FAMILY_KEYS, path)
    fam = doc.get("family", {})
    _keys(fam, {"scope", "layers", "experts", "storage", "description", "config_file", "index_file"},
          f"{path}: family")
    for key in ("layers", "experts"):
        if not isinstance(fam.get(key), str):
            raise SpecError(f"{path}: family.{key}", "names the config key that --" + key + " sets")
    storage = fam.get("storage", "bf16")
    if storage not in STORAGES:
        raise SpecError(f"{path}: family.storage", f"unknown storage {storage!r}")
    parts: dict[str, tuple] = {}
    for name, items in doc.get("parts", {}).items():
        parts[name] = _entries(items, f"{path}: parts.{name}", parts, storage)
    files = doc.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise SpecError(f"{path}: files", "files is a table of file name -> text")
    if not isinstance(doc.get("config"), dict):
        raise SpecError(f"{path}: config", "a family needs its [config] (the config.json it writes)")
    return Family(path, doc["config"], tuple(fam.get("scope", ())), fam["layers"], fam["experts"],
                  _exprs(doc.get("sets", {}), f"{path}: sets"), _exprs(doc.get("let", {}), f"{path}: let"),
                  _blocks(doc.get("blocks"), path, parts, storage), files,
                  _sharding(doc.get("sharding", {}), f"{path}: sharding", Sharding()), *_file_names(fam, path))


def _file_names(fam: dict, path: str) -> tuple[str, str]:
    """The config's and the index's file names: a release in Mistral's own layout writes params.json and
    consolidated.safetensors.index.json."""
    names = (fam.get("config_file", Family.config_file), fam.get("index_file", Family.index_file))
    if not all(isinstance(n, str) and n.endswith(".json") and "/" not in n for n in names):
        raise SpecError(f"{path}: family", "config_file and index_file are top-level *.json file names")
    return names


def parse_variants(doc: dict, path: str, sharding: Sharding) -> dict[str, Variant]:
    out = {}
    presets = doc.get("presets", {})
    if not isinstance(presets, dict):
        raise SpecError(f"{path}: presets", "expected [presets.NAME] tables")
    for name, v in presets.items():
        where = f"{path}: presets.{name}"
        _keys(v, {"description", "shards", "config", "sharding"}, where)
        shards = v.get("shards", 4)
        if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
            raise SpecError(f"{where}: shards", f"a positive integer, got {shards!r}")
        if not isinstance(v.get("description", ""), str) or not isinstance(v.get("config", {}), dict):
            raise SpecError(where, "description is a string, config a table")
        out[name] = Variant(name, where, v.get("description", ""), shards, v.get("config", {}),
                            _sharding(v.get("sharding", {}), f"{where}: sharding", sharding))
    return out


def read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConvertError(f"{path}: cannot read preset spec: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path}: not a TOML preset spec: {e}") from None
