"""Synthetic checkpoints laid out as the real releases, from preset spec files (docs/presets.md).

A family is one TOML file: its ``config.json``, its tensors in the release's order (name templates,
shapes over config keys, storage), its shard cuts and side files; its size variants (``tiny-*``,
``bench-*``) are config values. This package holds the one generator; ``presets/`` the families and the
variants users and benchmarks name (``tiny-k3``, ``bench-*``, ``k3-full-sparse``); the variants only the
tests use live in ``tests/presets/``. ``kimi-convert synth`` takes a preset name or a spec file
(``FILE.toml`` with one variant, or ``FILE.toml:NAME``).

Values are deterministic for a seed: each tensor draws from its own generator seeded by its name
(``values.py``), so any order, sharding or ``--jobs`` gives the same bytes.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import shutil
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import ConvertError
from ..gcpause import gc_paused
from ..safetensors_format import HeaderTensor, encode_header
from ..write import default_mode
from .layout import Logical, Shard, byte_cuts, count_cuts, plan_shards, shard_name, tensors
from .resolve import Preset, make_preset
from .spec import Family, SpecError, Variant, parse_family, parse_variants, read_toml
from .values import fp8_block, mxfp4, tensor_values, weight

__all__ = ["Preset", "SpecError", "builtin_presets", "byte_cuts", "config", "count_cuts", "find_preset",
           "fp8_block", "index_text", "load_preset", "mxfp4", "plan_shards", "tensor_specs", "tensors", "weight",
           "write_synth"]


def _load(doc: dict, label: str) -> tuple[Family, dict[str, Variant]]:
    """A spec document: a family with its variants, or (``base = "FAMILY"``) variants of a built-in family."""
    if "base" in doc:
        extra = sorted(set(doc) - {"base", "presets"})
        if extra:
            raise SpecError(label, f"a spec with base = ... holds only [presets.*], not {extra[0]!r}")
        families = _builtin_families()
        if doc["base"] not in families:
            raise SpecError(f"{label}: base", f"unknown family {doc['base']!r} (built in: {', '.join(families)})")
        family = families[doc["base"]][0]
    else:
        family = parse_family(doc, label)
    return family, parse_variants(doc, label, family.sharding)


@functools.cache
def _builtin_families() -> dict[str, tuple[Family, dict[str, Variant]]]:
    """The families shipped in ``kimi_convert.presets`` (by file stem) with their variants."""
    files = resources.files("kimi_convert.presets")
    out = {}
    for f in sorted(files.iterdir(), key=lambda f: f.name):
        if f.name.endswith(".toml"):
            label = f"presets/{f.name}"
            try:
                doc = tomllib.loads(f.read_text(encoding="utf-8"))
            except ValueError as e:
                raise ConvertError(f"{label}: not a TOML preset spec: {e}") from None
            out[f.name[: -len(".toml")]] = _load(doc, label)
    return out


def builtin_presets() -> dict[str, tuple[Family, Variant]]:
    """Every built-in preset name -> its family and variant."""
    return {name: (fam, v) for fam, variants in _builtin_families().values() for name, v in variants.items()}


def _spec_file(ref: str) -> tuple[Path, str | None]:
    path, sep, name = ref.rpartition(".toml:")
    return (Path(path + ".toml"), name) if sep else (Path(ref), None)


def load_preset(ref: str, layers: int | None = None, experts: int | None = None, shards: int | None = None
                ) -> Preset:
    """A built-in preset by name, or a spec file's variant (``FILE.toml`` holding one, ``FILE.toml:NAME``)."""
    if ".toml" not in ref:
        known = builtin_presets()
        if ref not in known:
            raise ConvertError(f"unknown preset {ref!r}; known: {', '.join(known)}; or a spec file FILE.toml[:NAME]")
        family, v = known[ref]
        return make_preset(family, v, layers, experts, shards)
    path, name = _spec_file(ref)
    family, variants = _load(read_toml(path), str(path))
    if name is None and len(variants) != 1:
        raise ConvertError(f"{path}: holds {len(variants)} presets ({', '.join(variants) or 'none'}); "
                           f"name one as {path}:NAME")
    if name is not None and name not in variants:
        raise ConvertError(f"{path}: no preset {name!r} (it holds {', '.join(variants) or 'none'})")
    return make_preset(family, variants[name or next(iter(variants))], layers, experts, shards)


def find_preset(name: str, folders: list[Path]) -> str:
    """``name`` as :func:`load_preset` takes it: a built-in name, or ``FILE.toml:name`` for the first spec
    file in ``folders`` that holds it (the tests' presets)."""
    if name in builtin_presets():
        return name
    for folder in folders:
        for f in sorted(Path(folder).glob("*.toml")):
            if name in read_toml(f).get("presets", {}):
                return f"{f}:{name}"
    raise ConvertError(f"unknown preset {name!r}: not built in, not in {', '.join(map(str, folders))}")


def config(p: Preset) -> dict:
    """The config.json the preset writes."""
    return p.config()


_TORCH = {"bf16": torch.bfloat16, "f32": torch.float32, "fp8-block": torch.float8_e4m3fn, "mxfp4-pack": torch.uint8,
          "int4-pack": torch.int32, "expert-ids": torch.int64}


def tensor_specs(p: Preset) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every tensor (name, shape, dtype) as the release describes it: an FP8 block weight as float8 (its
    scale implied), a compressed-tensors MXFP4 weight as uint8 with its logical shape, a gpt-oss bank as
    its stored ``_blocks`` and ``_scales``."""
    for t in tensors(p):
        if t.storage == "mxfp4-bank":
            yield from ((part.name, part.shape, torch.uint8) for part in t.parts)
        else:
            yield t.name, t.shape, _TORCH[t.storage]


def _prepare(out: Path, overwrite: bool, config_file: str = "config.json") -> None:
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ConvertError(f"{out}: not empty; pass --overwrite to replace it")
        if not (out / config_file).exists():
            raise ConvertError(f"{out}: not empty and not a checkpoint; refusing to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def write_synth(preset: str | Preset, out: str | Path, seed: int = 0, layers: int | None = None,
                experts: int | None = None, overwrite: bool = False, jobs: int = 1,
                shards: int | None = None) -> Path:
    """Write the preset's checkpoint into ``out``; ``jobs`` shards at once (threads: torch releases the
    GIL), the same bytes for any ``jobs``. The spec is fully checked (layout, config) before ``out`` is
    touched, so a spec error leaves no half-written folder."""
    p = preset if isinstance(preset, Preset) else load_preset(preset, layers, experts, shards)
    cfg = config(p)
    with gc_paused():  # k3-full-sparse: 250k tensors, 500k parts, no cycles
        plan = None if p.sparse else plan_shards(p)
        parts = None if plan is not None else [(t, part) for t in tensors(p) for part in t.parts]
    out = Path(out)
    _prepare(out, overwrite, p.family.config_file)
    if parts is not None:
        weight_map, total = write_sparse(p, out, parts)
    else:
        def one(shard: Shard) -> dict[str, int]:
            return _write_shard(shard, out, seed)

        if jobs <= 1:
            sizes = [one(s) for s in plan]
        else:
            with ThreadPoolExecutor(jobs, thread_name_prefix="kimi-convert-synth") as ex:
                sizes = list(ex.map(one, plan))
        weight_map = {k: s.file for s, sz in zip(plan, sizes, strict=True) for k in sz}
        total = sum(sum(sz.values()) for sz in sizes)
    (out / p.family.index_file).write_text(index_text(weight_map, total, p.sparse))
    (out / p.family.config_file).write_text(json.dumps(cfg, indent=2) + "\n")
    for name, text in p.family.files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    return out


def _write_shard(shard: Shard, out: Path, seed: int) -> dict[str, int]:
    """One shard's file; its stored tensors' sizes in the index's order."""
    stored: dict[str, torch.Tensor] = {}
    for t, parts in shard.items:
        for part, value in zip(t.parts, tensor_values(t, seed), strict=True):
            if part in parts:
                stored[part.name] = value
    save_file(stored, str(out / shard.file), metadata={"format": "pt"})
    os.chmod(out / shard.file, default_mode())  # save_file makes 0o600; every file of the folder the same
    return {k: v.numel() * v.element_size() for k, v in stored.items()}


_PLAIN = re.compile(r"[\w.\-]*", re.ASCII)  # names json writes as they are, between quotes


def index_text(weight_map: dict[str, str], total: int, sort_keys: bool = False) -> str:
    """The index as ``json.dumps(indent=2)`` writes it (sorted, as ``save_pretrained`` writes it, for the
    sparse presets); sorted without json's pure-Python indenting encoder (5x faster for 500k names)."""
    plain = all(_PLAIN.fullmatch(k) and _PLAIN.fullmatch(v) for k, v in weight_map.items())
    if not sort_keys or not plain:
        return json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2,
                          sort_keys=sort_keys) + "\n"
    rows = ",\n".join(f'    "{k}": "{weight_map[k]}"' for k in sorted(weight_map))
    return f'{{\n  "metadata": {{\n    "total_size": {total}\n  }},\n  "weight_map": {{\n{rows}\n  }}\n}}\n'


# safetensors orders a file's data by dtype (its enum order, descending), then by name; so do we.
_ST_DTYPE_RANK = {"U8": 4, "F8_E4M3": 7, "F8_E8M0": 8, "BF16": 12, "F32": 15}


def _sparse_groups(parts: list, shards: int) -> list[list]:
    """Parts cut by bytes into at most ``shards`` groups, never between two parts of one tensor."""
    total = sum(part.nbytes for _, part in parts)
    groups: list[list] = [[]]
    done, k = 0, 1
    for i, (t, part) in enumerate(parts):
        first_part = i == 0 or parts[i - 1][0] is not t
        if done >= total * k / shards and groups[-1] and first_part:
            groups.append([])
            while done >= total * k / shards:
                k += 1
        groups[-1].append(part)
        done += part.nbytes
    return groups


def write_sparse(p: Preset, out: Path, parts: list[tuple[Logical, object]]) -> tuple[dict[str, str], int]:
    """Shards with real safetensors headers and every data region a hole (``os.truncate``, no data
    written): the release's inventory at full size on a few hundred MB of real disk. Shards are cut by
    bytes, at most ``p.shards`` of them, a tensor's parts in one shard. Deterministic."""
    groups = _sparse_groups(parts, p.shards)
    weight_map: dict[str, str] = {}
    for s, group in enumerate(groups):
        fname = shard_name(p, s, len(groups))
        group.sort(key=lambda part: (-_ST_DTYPE_RANK[part.dtype], part.name))
        starts = list(itertools.accumulate((part.nbytes for part in group), initial=0))
        head = encode_header([HeaderTensor(part.name, part.dtype, part.shape) for part in group], starts[:-1],
                             starts[1:], align=8)  # the header written as pack writes its own (8-byte aligned)
        weight_map.update(dict.fromkeys((part.name for part in group), fname))
        path = out / fname
        with open(path, "wb") as f:
            f.write(head)
        os.truncate(path, len(head) + starts[-1])
    return weight_map, sum(part.nbytes for _, part in parts)
