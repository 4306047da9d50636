"""The plan as data: ``plan --json``'s text, the manifest's skeleton and the plan's identity (its hash).

Everything here is a function of the plan alone (no hashes of tensor data): the manifest adds those
(``manifest.py``), the text rendering is ``render.py``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator

from .. import formats, schemes
from ..gcpause import gc_paused
from .model import COPY, KEEP, EngineGroup, Item, Kind, Plan

#: modules written per piece of ``plan_json`` (a piece is joined text: fewer, larger writes)
_BATCH = 4096
#: json.dumps's C encoder; the plan's dicts hold no cycles, and not checking for them is 1.4x faster
_ENCODE = json.JSONEncoder(check_circular=False).encode
#: ``json.dumps(x, sort_keys=True)``'s encoder (``plan_sha256``: the plan's hash is of that text)
_SORTED = json.JSONEncoder(sort_keys=True).encode


def plan_dict(plan: Plan) -> dict:
    """The plan as data (no hashes): what ``plan --json`` prints, the manifest's skeleton."""
    body = head_dict(plan)
    body["modules"] = list(_modules(plan))
    body["engine_groups"] = engine_groups(plan)
    return body


def plan_hash(plan_dict: dict) -> str:
    """The plan's identity (the manifest's ``plan_sha256``; a resume refuses another plan's output)."""
    return hashlib.sha256(json.dumps(plan_dict, sort_keys=True).encode()).hexdigest()


def plan_sha256(plan: Plan) -> str:
    """``plan_hash(plan_dict(plan))`` without holding ``plan_dict``: the same text (``json.dumps`` with sorted
    keys) hashed piece by piece, each module and engine packed module encoded alone. On the released K3 the
    dict and its text held at once were 1.5 GB on top of the plan, the pack's peak before its first read
    (benchmarks/RESULTS.md, issue 43)."""
    h = hashlib.sha256()
    for piece in _sorted_json(plan):
        h.update(piece.encode())
    return h.hexdigest()


def _sorted_json(plan: Plan) -> Iterator[str]:
    """``json.dumps(plan_dict(plan), sort_keys=True)`` in pieces: the head's keys in sorted order, the two long
    lists one element at a time (``json.dumps`` writes a list as its elements joined by ``", "``)."""
    with gc_paused():
        head = head_dict(plan)
        lists = {"modules": _modules(plan), "engine_groups": iter(engine_groups(plan))}
        yield "{"
        for i, key in enumerate(sorted(head)):
            yield (", " if i else "") + json.dumps(key) + ": "
            if key not in lists:
                yield _SORTED(head[key])
                continue
            yield "["
            it, first = lists[key], True
            for batch in iter(lambda it=it: list(itertools.islice(it, _BATCH)), []):
                yield ("" if first else ", ") + ", ".join(map(_SORTED, batch))
                first = False
            yield "]"
        yield "}"


def _modules(plan: Plan) -> Iterator[dict]:
    """plan_dict's "modules", one output shard's part of the plan at a time (``Plan.shard_parts``: a banked
    plan's expanded from its outline, never held whole)."""
    for part in plan.shard_parts():
        for u in part.units:
            for it in u.items:
                yield item_dict(it, u.shared_scale, u.shard)


def head_dict(plan: Plan) -> dict:
    """plan_dict in its key order, with its two long lists ("modules", "engine_groups") left empty: counted
    from the outline (a bank counted in full), not from the modules."""
    kinds = plan.outline.kinds
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
        "shards": [{"file": s.file, "size": s.size, "tensors": s.tensors} for s in plan.shard_sizes()],
        "totals": {"bytes_in": plan.bytes_in, "bytes_out": plan.bytes_out,
                   **{s.TOTALS: kinds[Kind(n)] for n, s in schemes.SCHEMES.items()},
                   "kept": kinds[KEEP], "copied": kinds[COPY]},
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


def engine_groups(plan: Plan) -> list[dict]:
    """The engine packed modules, each with the global scale its members share (None where apart)."""
    return [_engine_group(g, scale) for g, scale in plan.engine_group_scales()]


def _engine_group(g: EngineGroup, shared_scale: str | None) -> dict:
    return {"name": g.name, "engines": list(g.engines), "members": list(g.members),
            "rows": [list(r) for r in g.rows], "shared_scale": shared_scale}


def _recipe(plan: Plan) -> dict:
    """The recipe as the manifest names it (the output format only where it is not the default)."""
    r = plan.recipe
    d = {"name": r.name, "file": r.path, "sha256": r.sha256, "quant_method": r.quant_method,
         "quant_algo": r.quant_algo}
    if r.output_format != formats.DEFAULT:
        d["output_format"] = r.output_format
    return d


def item_dict(it: Item, shared_scale: str | None, shard: str) -> dict:
    """One module of the plan: its decision and rule, its sources (with the rows each fills) and the
    tensors it writes into ``shard``; the manifest's record of it adds the hashes."""
    d: dict = {"name": it.name, "kind": it.kind, "rule": it.rule}
    if it.group:
        d["group"] = it.group
    d["op"] = it.op
    if it.experts:
        d["experts"] = it.experts  # a stacked expert bank: one global scale per expert
    if schemes.quantized(it.kind):
        d["quantization"] = formats.record(it, shared_scale)
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
            **({"view": [list(v) for v in s.view]} if s.view else {}),  # [dim, start, stop, step] of every part
        }
        for s, r in zip(it.sources, it.row_ranges(), strict=True)
    ]
    d["tensors"] = [{"name": t.name, "file": shard, "dtype": t.dtype, "shape": list(t.shape)} for t in it.outputs]
    return d


def plan_json(plan: Plan, extra: dict | None = None) -> Iterator[str]:
    """``{**plan_dict(plan), **extra}`` as JSON text, in pieces, without holding plan_dict: the head
    indented, and each module and engine packed module on a line of its own (``grep`` finds a module;
    the released K3's 250,000 modules are 0.4 GB of text). Each line is ``json.dumps`` of one dict, whose
    C encoder is fast; ``json.dumps(indent=...)`` is pure Python (a minute for the released K3)."""
    with gc_paused():  # (while suspended too: it makes only acyclic objects)
        head = {**head_dict(plan), **(extra or {})}
        head["modules"], head["engine_groups"] = "\0modules", "\0engine_groups"
        text = json.dumps(head, indent=2)
        before, rest = text.split(json.dumps("\0modules"))
        between, after = rest.split(json.dumps("\0engine_groups"))
        yield before
        yield from _lines(_modules(plan))
        yield between
        yield from _lines(engine_groups(plan))
        yield after


def _lines(dicts: Iterator[dict] | list[dict]) -> Iterator[str]:
    """A JSON list at depth 1 of an indented object, one element a line."""
    it = iter(dicts)
    first = True
    for batch in iter(lambda: list(itertools.islice(it, _BATCH)), []):
        yield ("[\n    " if first else ",\n    ") + ",\n    ".join(map(_ENCODE, batch))
        first = False
    yield "[]" if first else "\n  ]"
