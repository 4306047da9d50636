"""The manifest: the plan, made concrete with hashes. It is what verify-manifest checks an output
against, and it says for every output tensor where its bytes came from.

It holds no timestamps and no absolute paths, so the same input and options give the same bytes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _json_str
from pathlib import Path, PurePosixPath

from . import __version__, filenames, formats
from .atomic import write_atomic
from .checkpoint import gc_paused
from .errors import ConvertError
from .jsonfile import loads, read_json
from .plan import COPY, FP8, KEEP, NVFP4, Item, Plan, Unit

FORMAT = "kimi-convert-manifest"
#: 2: ``side_files`` became records (file, size, sha256), ``side_folders`` and ``skipped_files`` came.
#: 3: ``modules`` moved out of manifest.json into one JSON Lines file per output shard (``records``).
#: Version 1 and 2 manifests (every module in manifest.json, before 0.1.0) are refused by verify-manifest.
FORMAT_VERSION = 3


def plan_dict(plan: Plan) -> dict:
    """The plan as data (no hashes): printed by ``kimi-convert plan --json``, the manifest's skeleton."""
    shard_of = plan.shard_of()
    scale_of = _scale_of(plan)
    body = _plan_head(plan)
    body["modules"] = [_item(it, u.shared_scale, shard_of) for u in plan.units for it in u.items]
    body["engine_groups"] = [_engine_group(g, scale_of) for g in plan.engine_groups]
    return body


def _scale_of(plan: Plan) -> dict[str, str]:
    return {it.name: u.shared_scale for u in plan.units if u.shared_scale for it in u.items}


def _engine_group(g, scale_of: dict[str, str]) -> dict:
    return {"name": g.name, "engines": list(g.engines), "members": list(g.members),
            "rows": [list(r) for r in g.rows], "shared_scale": scale_of.get(g.members[0])}


def _plan_head(plan: Plan) -> dict:
    """plan_dict in its key order, the lists "modules" and "engine_groups" left empty."""
    items = plan.items
    return {
        "mapping": {"name": plan.mapping.name, "file": plan.mapping.path, "sha256": plan.mapping.sha256},
        "recipe": _recipe(plan),
        "options": plan.options.to_dict(),
        "notes": list(plan.notes),
        "rules": [{"pattern": p.text, "origin": p.origin, "reason": p.reason} for p in plan.patterns],
        "warnings": list(plan.warnings),
        "exclude_modules": list(plan.exclude_modules),
        "quantized_layers": formats.get(plan.recipe.output_format).manifest_layers(plan),
        "modules": [],
        "engine_groups": [],
        "shards": [{"file": s.file, "size": s.size, "tensors": len(s.placed)} for s in plan.shards],
        "totals": {"bytes_in": plan.bytes_in, "bytes_out": plan.bytes_out,
                   "nvfp4": sum(it.kind == NVFP4 for it in items),
                   "fp8_block": sum(it.kind == FP8 for it in items),
                   "kept": sum(it.kind == KEEP for it in items),
                   "copied": sum(it.kind == COPY for it in items)},
    }


def side_dict(plan: Plan, side_files: list[dict] | None = None) -> dict:
    """What the input tree gave besides the weights: the files copied (with size and sha256 once
    pack has copied them; names only for ``plan``), the empty folders recreated, and the files
    skipped with the reason. Kept out of ``plan_dict``: the plan's hash covers the weights only, so
    manifests written before side files were recorded still re-plan to their ``plan_sha256``."""
    return {
        "side_files": side_files if side_files is not None else [{"file": f} for f in plan.side_files],
        "side_folders": list(plan.side_folders),
        "skipped_files": [s.to_dict() for s in plan.skipped_files],
    }


# ``plan --json`` of the released K3 is 680 MB: 250,000 modules. json.dumps(indent=2) is pure Python
# (a minute), and the dict behind it several GB. plan_json writes the same text in pieces instead: each
# module and engine packed module from a template made once per structure (the JSON of the first one with
# its strings taken out), filled with the strings of the next by %-formatting.
_MARK = "\x00"
_MARK_JSON = json.dumps(_MARK)
_BATCH = 4096  # elements per piece


def plan_json(plan: Plan, extra: dict | None = None) -> Iterator[str]:
    """``json.dumps({**plan_dict(plan), **extra}, indent=2)``, in pieces, without building plan_dict."""
    with gc_paused():  # (while suspended too: it makes only acyclic objects)
        yield from _plan_json(plan, extra or {})


def _plan_json(plan: Plan, extra: dict) -> Iterator[str]:
    head = {**_plan_head(plan), **extra}
    head["modules"], head["engine_groups"] = _MARK + "modules", _MARK + "engine_groups"
    text = json.dumps(head, indent=2)
    before, rest = text.split(json.dumps(_MARK + "modules"))
    between, after = rest.split(json.dumps(_MARK + "engine_groups"))
    yield before
    stamp = _Stamp()
    yield from _elements(stamp.item(it, u.shared_scale, u.shard) for u in plan.units for it in u.items)
    yield between
    scale_of = _scale_of(plan)
    yield from _elements(stamp.group(g, scale_of) for g in plan.engine_groups)
    yield after


def _elements(texts: Iterator[str]) -> Iterator[str]:
    """A list's elements (at depth 2) as json.dumps(indent=2) writes the list at depth 1."""
    first = True
    for batch in iter(lambda: list(itertools.islice(texts, _BATCH)), []):
        yield ("[\n" if first else ",\n") + ",\n".join(batch)
        first = False
    yield "[]" if first else "\n  ]"


def _at_depth_2(d: object) -> str:
    return "    " + json.dumps(d, indent=2).replace("\n", "\n    ")


def _take_strings(d: object, out: list[str]) -> object:
    """``d`` with every string value replaced by _MARK (the strings appended to ``out``, in JSON order)."""
    if isinstance(d, str):
        out.append(d)
        return _MARK
    if isinstance(d, dict):
        return {k: _take_strings(v, out) for k, v in d.items()}
    if isinstance(d, list):
        return [_take_strings(v, out) for v in d]
    return d


class _Stamp:
    """JSON texts from templates, one per structure key. The first element of a key is rendered by
    json.dumps from its dict (_item, _engine_group); its strings must be the ones _item_parts /
    _group_parts list for it, else that key is always rendered from its dict. A template is the text
    cut around its strings (quotes kept); strings that need no JSON escape go in as they are."""

    def __init__(self) -> None:
        self.templates: dict[tuple, list[str] | None] = {}

    def _text(self, key: tuple, strings: list[str], build) -> str:
        pieces = self.templates.get(key, ())
        if pieces:
            raw = "".join(strings)  # json.dumps escapes in ASCII only '"', '\\' and controls (not printable)
            if not (raw.isascii() and raw.isprintable()) or '"' in raw or "\\" in raw:
                strings = [_json_str(x)[1:-1] for x in strings]
            out = pieces.copy()
            out[1::2] = strings
            return "".join(out)
        d = build()
        if pieces is None:
            return _at_depth_2(d)
        taken: list[str] = []
        cut = _at_depth_2(_take_strings(d, taken)).split(_MARK_JSON)  # around each string, its quotes cut off
        pieces = [f'"{c}"' for c in cut]
        pieces[0], pieces[-1] = pieces[0][1:], pieces[-1][:-1]
        self.templates[key] = [x for p in pieces for x in (p, "")][:-1] if taken == strings else None
        return _at_depth_2(d)

    def item(self, it: Item, shared_scale: str | None, shard: str) -> str:
        key, strings = _item_parts(it, shared_scale, shard)
        return self._text(key, strings,
                          lambda: _item(it, shared_scale, dict.fromkeys((t.name for t in it.outputs), shard)))

    def group(self, g, scale_of: dict[str, str]) -> str:
        shared = scale_of.get(g.members[0])
        key = ("group", len(g.engines), len(g.members), g.rows, shared is None)
        strings = [g.name, *g.engines, *g.members, *(() if shared is None else (shared,))]
        return self._text(key, strings, lambda: _engine_group(g, scale_of))


def _recipe(plan: Plan) -> dict:
    """The recipe as the manifest names it (the output format only where it is not the default)."""
    r = plan.recipe
    d = {"name": r.name, "file": r.path, "sha256": r.sha256, "quant_method": r.quant_method,
         "quant_algo": r.quant_algo}
    if r.output_format != formats.DEFAULT:
        d["output_format"] = r.output_format
    return d


def _item_parts(it: Item, shared_scale: str | None, shard: str) -> tuple[tuple, list[str]]:
    """What _item(it, ...) renders: a key for all but its strings, and its strings in JSON order
    (mirrors _item; checked once per key)."""
    key: list = ["item", it.kind, it.op, bool(it.group)]
    out = [it.name, it.kind, it.rule]
    if it.group:
        out.append(it.group)
    out.append(it.op)
    if it.kind == NVFP4:
        key += (it.input_scale, shared_scale is None, it.output_format)
        out += (NVFP4, formats.get(it.output_format).layer_algo(it.kind, it.input_scale))
        if shared_scale is not None:
            out.append(shared_scale)
    elif it.kind == FP8:
        key.append(it.output_format)
        out += (FP8, formats.get(it.output_format).layer_algo(it.kind, None))
    for s in it.sources:
        key += (s.shape, len(s.parts))
        out += (s.name, s.module, s.file, s.encoding, s.dtype)
        for p in s.parts:
            key.append(p.shape)
            out += (p.name, p.file, p.dtype)
    key.append(None)
    for t in it.outputs:
        key.append(t.shape)
        out += (t.name, shard, t.dtype)
    return tuple(key), out


def _item(it: Item, shared_scale: str | None, shard_of: dict[str, str]) -> dict:
    d: dict = {"name": it.name, "kind": it.kind, "rule": it.rule}
    if it.group:
        d["group"] = it.group
    d["op"] = it.op
    if it.kind in (NVFP4, FP8):
        d["quantization"] = formats.get(it.output_format).record(it, shared_scale)
    d["sources"] = [
        {
            "name": s.name,
            "module": s.module,
            "file": s.file,
            "encoding": s.encoding,
            "dtype": s.dtype,
            "shape": list(s.shape),
            "rows": list(r),
            "parts": [{"name": p.name, "file": p.file, "dtype": p.dtype, "shape": list(p.shape)} for p in s.parts],
        }
        for s, r in zip(it.sources, it.row_ranges(), strict=True)
    ]
    d["tensors"] = [
        {"name": t.name, "file": shard_of[t.name], "dtype": t.dtype, "shape": list(t.shape)} for t in it.outputs
    ]
    return d


RECORDS_DIR, records_name = filenames.RECORDS_DIR, filenames.records_name


def module_record(it: Item, shared_scale: str | None, shard: str, tensor_hashes: dict[str, str],
                  source_hashes: dict[str, str], notes: dict[str, dict]) -> dict:
    """One module as the manifest records it: the plan's entry (``plan --json``) with the sha256 of
    each stored source part and output tensor, and the compute's notes (amax, cast counts...)."""
    mod = _item(it, shared_scale, dict.fromkeys((t.name for t in it.outputs), shard))
    for s in mod["sources"]:
        for p in s["parts"]:
            p["sha256"] = source_hashes[p["name"]]
    for t in mod["tensors"]:
        t["sha256"] = tensor_hashes[t["name"]]
    note = dict(sorted(notes.get(it.name, {}).items()))  # key order must not depend on a resume
    if note and it.kind in (NVFP4, FP8):
        mod["quantization"].update(note)
    elif note:
        mod["decoded"] = note
    return mod


@dataclass(frozen=True)
class RecordsFile:
    """A shard's records file as written: what manifest.json lists (and the journal keeps)."""

    file: str
    size: int
    sha256: str
    modules: int

    def to_dict(self) -> dict:
        return {"file": self.file, "size": self.size, "sha256": self.sha256, "modules": self.modules}


def write_records(output_dir: Path, shard: str, units: list[Unit], tensor_hashes: dict[str, str],
                  source_hashes: dict[str, str], notes: dict[str, dict]) -> RecordsFile:
    """Write ``shard``'s module records (its units, in plan order), one compact JSON object a line,
    atomically. Called by whoever wrote the shard (a stream, in a worker or a Ray task) once the
    shard is complete: the records are a function of the plan and the shard's hashes only, so the
    file is the same bytes whatever wrote it, and on every resume."""
    lines = [json.dumps(module_record(it, u.shared_scale, shard, tensor_hashes, source_hashes, notes),
                        separators=(",", ":")) + "\n" for u in units for it in u.items]
    data = "".join(lines).encode()
    rel = records_name(shard)
    path = output_dir / rel
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConvertError(f"{path.parent}: cannot create: {e.strerror or e}") from None
    write_atomic(path, data, fault="records")
    return RecordsFile(rel, len(data), hashlib.sha256(data).hexdigest(), len(lines))


def build(plan: Plan, plan_sha256: str, input_hashes: dict[str, str], shards: dict[str, tuple[int, str]],
          records: dict[str, RecordsFile], files: list[dict], side_files: list[dict]) -> dict:
    """manifest.json (format_version 3): everything but the per-module records, which are in
    ``records`` (one file per output shard, each with its size, sha256 and number of modules).
    ``shards``: output shard -> (size, sha256); ``files``: every other file of the output (configs,
    index, side files) with size and sha256; ``side_files``: those of them copied from the input."""
    head = _plan_head(plan)
    del head["modules"]
    scale_of = _scale_of(plan)
    head["engine_groups"] = [_engine_group(g, scale_of) for g in plan.engine_groups]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tool": {"name": "kimi-convert", "version": __version__},
        "plan_sha256": plan_sha256,
        "mapping_table": tomllib.loads(plan.mapping.source),
        "mapping_source": plan.mapping.source,
        "recipe_source": plan.recipe.source,
        "inputs": [{"file": f, "size": size, "sha256": input_hashes[f]} for f, size in plan.inputs],
        **side_dict(plan, side_files),
        "outputs": [{"file": f, "size": size, "sha256": h} for f, (size, h) in sorted(shards.items())],
        "records": [{"shard": f, **records[f].to_dict()} for f in sorted(shards)],
        "files": files,
        **head,
    }


def plan_hash(plan_dict: dict) -> str:
    """The plan's identity (the manifest's ``plan_sha256``; a resume refuses another plan's output)."""
    return hashlib.sha256(json.dumps(plan_dict, sort_keys=True).encode()).hexdigest()


def load_manifest(output_dir: Path) -> dict:
    path = output_dir / filenames.MANIFEST
    return read_json(path, str(path))


def is_v3(man: dict) -> bool:
    """Whether the module records are in records files (format_version 3) rather than manifest.json."""
    return "records" in man and "modules" not in man


def iter_modules(output_dir: Path, man: dict, problems: list[str] | None = None) -> Iterator[tuple[str, dict]]:
    """Every module record with where it was read (``manifest-records/X.jsonl line N``), streamed: the
    records files are read one line at a time, never whole. ``problems`` collects what is wrong with a
    records file (missing, a line that is not a record, size or sha256 not the listed ones)."""
    for entry in man["records"]:
        reader = RecordsReader(output_dir, entry)
        yield from reader
        if problems is not None:
            problems += reader.problems


class RecordsReader:
    """One records file, read a line at a time and hashed from the same bytes; after iterating,
    ``problems`` says what was wrong (missing, truncated, a line that is not a record, edited: its
    size, sha256 or number of records differ from manifest.json's listing)."""

    def __init__(self, output_dir: Path, entry: dict):
        self.output_dir, self.entry = output_dir, entry
        self.name: str = entry["file"]
        self.problems: list[str] = []
        self.stopped = False  # missing, or a line that is not a record: the records after it are unknown

    def __iter__(self) -> Iterator[tuple[str, dict]]:
        name = self.name
        rel = PurePosixPath(name)
        if not name or rel.is_absolute() or ".." in rel.parts:  # never read a file outside the output
            self.problems.append(f"manifest.json: records file {name!r} is not a relative path inside the output")
            self.stopped = True
            return
        h, size, n = hashlib.sha256(), 0, 0
        try:
            f = open(self.output_dir / name, "rb")  # noqa: SIM115 - closed by the with below (a generator)
        except OSError as e:
            self.problems.append(f"{name}: {'missing' if isinstance(e, FileNotFoundError) else e.strerror}"
                                 f" (the records of shard {self.entry.get('shard')})")
            self.stopped = True
            return
        with f:
            for n, line in enumerate(f, 1):
                h.update(line)
                size += len(line)
                rec = _parse_line(line)
                if rec is None:
                    why = "truncated (no end of line)" if not line.endswith(b"\n") else "not a JSON record"
                    self.problems.append(f"{name} line {n}: {why}")
                    self.stopped = True
                    return
                yield f"{name} line {n}", rec
        if size != self.entry["size"] or h.hexdigest() != self.entry["sha256"]:
            self.problems.append(f"{name}: {size} bytes, sha256 {h.hexdigest()[:16]}...; manifest.json says "
                                 f"{self.entry['size']} bytes, {self.entry['sha256'][:16]}... (edited or truncated)")
        elif n != self.entry["modules"]:
            self.problems.append(f"{name}: {n} records, manifest.json says {self.entry['modules']}")


def _parse_line(line: bytes) -> dict | None:
    if not line.endswith(b"\n"):
        return None
    try:
        rec = loads(line, "a records line")
    except ConvertError:
        return None
    return rec if isinstance(rec, dict) else None
