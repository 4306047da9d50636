"""The manifest: the plan, made concrete with hashes. It is what verify-manifest checks an output
against, and it says for every output tensor where its bytes came from.

It holds no timestamps and no absolute paths, so the same input and options give the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

from . import __version__
from .configs import layer_algo, quantized_layers
from .errors import ConvertError
from .plan import FP8, GROUP_SIZE, NVFP4, Item, Plan
from .recipe import FP8_BLOCK

FORMAT = "kimi-convert-manifest"
#: 2: ``side_files`` became records (file, size, sha256), ``side_folders`` and ``skipped_files`` came.
#: Version 1 manifests (``side_files`` a list of names) are still read.
FORMAT_VERSION = 2


def plan_dict(plan: Plan) -> dict:
    """The plan as data (no hashes): printed by ``kimi-convert plan --json``, the manifest's skeleton."""
    shard_of = plan.shard_of()
    scale_of = {it.name: u.shared_scale for u in plan.units if u.shared_scale for it in u.items}
    return {
        "mapping": {"name": plan.mapping.name, "file": plan.mapping.path, "sha256": plan.mapping.sha256},
        "recipe": {"name": plan.recipe.name, "file": plan.recipe.path, "sha256": plan.recipe.sha256,
                   "quant_method": plan.recipe.quant_method, "quant_algo": plan.recipe.quant_algo},
        "options": plan.options.to_dict(),
        "notes": list(plan.notes),
        "rules": [{"pattern": p.text, "origin": p.origin, "reason": p.reason} for p in plan.patterns],
        "warnings": list(plan.warnings),
        "exclude_modules": list(plan.exclude_modules),
        "quantized_layers": quantized_layers(plan) if plan.recipe.quant_method == "modelopt_mixed" else None,
        "modules": [_item(it, u.shared_scale, shard_of) for u in plan.units for it in u.items],
        "engine_groups": [{"name": g.name, "engines": list(g.engines), "members": list(g.members),
                           "rows": [list(r) for r in g.rows], "shared_scale": scale_of.get(g.members[0])}
                          for g in plan.engine_groups],
        "shards": [{"file": s.file, "size": s.size, "tensors": len(s.placed)} for s in plan.shards],
        "totals": {"bytes_in": plan.bytes_in, "bytes_out": plan.bytes_out,
                   "nvfp4": sum(it.kind == NVFP4 for it in plan.items),
                   "fp8_block": sum(it.kind == FP8 for it in plan.items),
                   "kept": sum(it.kind == "keep" for it in plan.items),
                   "copied": sum(it.kind == "copy" for it in plan.items)},
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


def _item(it: Item, shared_scale: str | None, shard_of: dict[str, str]) -> dict:
    d: dict = {"name": it.name, "kind": it.kind, "rule": it.rule}
    if it.group:
        d["group"] = it.group
    d["op"] = it.op
    if it.kind == NVFP4:
        d["quantization"] = {"format": NVFP4, "group_size": GROUP_SIZE,
                             "quant_algo": layer_algo(it.kind, it.input_scale), "shared_scale": shared_scale,
                             "input_scale": it.input_scale}
    elif it.kind == FP8:
        d["quantization"] = {"format": FP8, "block": [FP8_BLOCK, FP8_BLOCK], "quant_algo": layer_algo(it.kind, None)}
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


def build(plan: Plan, input_hashes: dict[str, str], output_hashes: dict[str, str],
          tensor_hashes: dict[str, str], source_hashes: dict[str, str], notes: dict[str, dict],
          output_sizes: dict[str, int], files: list[dict], side_files: list[dict]) -> dict:
    """``files``: every other file of the output (configs, index, side files) with size and sha256;
    ``side_files``: those of them copied from the input (the same bytes: the input's hashes too)."""
    body = plan_dict(plan)
    plan_sha256 = plan_hash(body)
    for mod in body["modules"]:
        for s in mod["sources"]:
            for p in s["parts"]:
                p["sha256"] = source_hashes[p["name"]]
        for t in mod["tensors"]:
            t["sha256"] = tensor_hashes[t["name"]]
        note = dict(sorted(notes.get(mod["name"], {}).items()))  # key order must not depend on a resume
        if note and mod["kind"] in (NVFP4, FP8):
            mod["quantization"].update(note)
        elif note:
            mod["decoded"] = note
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
        "outputs": [{"file": f, "size": output_sizes[f], "sha256": h} for f, h in sorted(output_hashes.items())],
        "files": files,
        **body,
    }


def plan_hash(plan_dict: dict) -> str:
    """The plan's identity (the manifest's ``plan_sha256``; a resume refuses another plan's output)."""
    return hashlib.sha256(json.dumps(plan_dict, sort_keys=True).encode()).hexdigest()


def load_manifest(output_dir: Path) -> dict:
    path = output_dir / "manifest.json"
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: unreadable ({e})") from None
    if not isinstance(obj, dict):
        raise ConvertError(f"{path}: not a JSON object")
    return obj
